# fl-edge image for NVIDIA Jetson Orin on JetPack 6.1/6.2 (L4T r36.4, Ubuntu 22.04,
# Python 3.10, CUDA 12.6, aarch64). PyTorch 2.5.0 and torchvision 0.20.0 come with the
# base image, built for the Jetson's integrated GPU (sm_87): no PyPI wheel runs there.
# deploy/constraints/jetpack6.txt pins them, so `pip install .` keeps them (it picks
# opacus 1.5.4, the newest for torch 2.5) or fails; the build then checks that the torch
# it ends with is the base's, with CUDA. Build on the Jetson:
#   docker build -f deploy/docker/edge-jetson.Dockerfile -t fedattn-edge-jetson .
# and run with `--runtime nvidia`. At start fl-edge runs one CUDA operation and names what
# is wrong (no driver mounted, another GPU generation) instead of training on the CPU.
# JetPack 5 (r35, Python 3.8) has no image: fedattn needs Python 3.10+ and torch 2.4+.
ARG BASE=dustynv/l4t-pytorch:r36.4.0
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --system --uid 10001 --create-home --home-dir /home/fedattn fedattn \
    && install -d -o fedattn -g fedattn /var/lib/fedattn
WORKDIR /opt/fedattn
COPY deploy/constraints ./deploy/constraints
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY fl_server ./fl_server
COPY fl_edge ./fl_edge
COPY tools ./tools
COPY proto ./proto
RUN python3 -c "import torch; print(torch.__version__)" > /tmp/torch-version \
    && pip3 install --no-cache-dir -c deploy/constraints/jetpack6.txt . \
    && python3 -c "import sys, torch; kept = open('/tmp/torch-version').read().strip(); sys.exit(None if torch.__version__ == kept and torch.version.cuda else f'torch {torch.__version__} replaced the base image torch {kept}')" \
    && rm /tmp/torch-version

USER 10001:10001
VOLUME ["/var/lib/fedattn"]
# Prometheus /metrics and the progress check /healthz (200 while the edge makes progress,
# 503 when it is stuck).
EXPOSE 9101
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9101/healthz', timeout=4)"]
# fl-edge is PID 1: it handles SIGTERM (docker stop) itself, finishing its state writes and
# telling the server it leaves. Give it the time: docker stop -t 30.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fl-edge"]
# Jetsons are small: a smaller local batch with gradient accumulation and fp16 keeps the
# server's effective batch (README, small devices).
CMD ["--insecure", "--device", "cuda", "--amp", "--data-dir", "/data", "--state-dir", "/var/lib/fedattn/edge", "--metrics-port", "9101"]
