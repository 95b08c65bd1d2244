# fl-edge image for NVIDIA Jetson (JetPack 6 / L4T r36, Ubuntu 22.04, Python 3.10, aarch64).
# PyTorch and torchvision come with the base image, built by NVIDIA for the Jetson's
# integrated GPU: the PyPI wheels do not run there, so constraints.txt (x86 pins) is not
# used and pip keeps the base's torch (fedattn needs torch>=2.1). Build on the Jetson:
#   docker build -f deploy/docker/edge-jetson.Dockerfile -t fedattn-edge-jetson .
# and run with `--runtime nvidia`. For JetPack 5 (r35, Python 3.8) there is no image:
# fedattn needs Python 3.10+.
ARG BASE=dustynv/l4t-pytorch:r36.4.0
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --system --uid 10001 --create-home --home-dir /home/fedattn fedattn \
    && install -d -o fedattn -g fedattn /var/lib/fedattn
WORKDIR /opt/fedattn
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY fl_server ./fl_server
COPY fl_edge ./fl_edge
COPY tools ./tools
COPY proto ./proto
# pip keeps the base's torch (it satisfies torch>=2.1); the check fails the build if
# anything replaced it with a wheel without CUDA.
RUN pip3 install --no-cache-dir . \
    && python3 -c "import torch; assert torch.version.cuda, 'torch is not a CUDA build'"

USER 10001:10001
VOLUME ["/var/lib/fedattn"]
EXPOSE 9101
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9101/metrics', timeout=4)"]
ENTRYPOINT ["fl-edge"]
# Jetsons are small: a smaller local batch with gradient accumulation and fp16 keeps the
# server's effective batch (README, small devices).
CMD ["--insecure", "--device", "cuda", "--amp", "--data-dir", "/data", "--state-dir", "/var/lib/fedattn/edge", "--metrics-port", "9101"]
