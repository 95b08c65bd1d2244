# fl-edge image for x86_64 GPU boxes. The PyPI torch wheel bundles the CUDA runtime, so a
# slim Python base is enough; the NVIDIA Container Toolkit mounts the driver at run time
# (`docker run --gpus all` / compose `deploy.resources.reservations.devices`).
# Which torch, by the host's driver and GPU (docs/operations.md, GPU boxes):
#   driver R580+, Turing (sm_75) or newer:           the default, constraints.txt (CUDA 13)
#     docker build -f deploy/docker/edge-cuda.Dockerfile -t fedattn-edge-cuda .
#   driver R525+, or Maxwell/Pascal/Volta (sm_50-70): torch 2.7.1, the CUDA 12.6 build
#     docker build -f deploy/docker/edge-cuda.Dockerfile \
#       --build-arg CONSTRAINTS=deploy/constraints/cuda12.txt -t fedattn-edge-cuda12 .
# At start fl-edge runs one CUDA operation and names a driver or GPU generation this torch
# cannot use (exit 2 with --device cuda). Private state lives in the volume /var/lib/fedattn.
FROM python:3.11-slim-bookworm

ARG CONSTRAINTS=constraints.txt
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

RUN useradd --system --uid 10001 --create-home --home-dir /home/fedattn fedattn \
    && install -d -o fedattn -g fedattn /var/lib/fedattn
WORKDIR /opt/fedattn
COPY constraints.txt ./
COPY deploy/constraints ./deploy/constraints
RUN pip install --no-cache-dir -c "${CONSTRAINTS}" torch torchvision
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY fl_server ./fl_server
COPY fl_edge ./fl_edge
COPY tools ./tools
COPY proto ./proto
# The same pins again, so no dependency can swap the torch installed above; the build
# fails if anything did.
RUN python -c "import torch; print(torch.__version__)" > /tmp/torch-version \
    && pip install --no-cache-dir -c "${CONSTRAINTS}" . \
    && python -c "import sys, torch; kept = open('/tmp/torch-version').read().strip(); sys.exit(None if torch.__version__ == kept and torch.version.cuda else f'torch {torch.__version__} replaced {kept}')" \
    && rm /tmp/torch-version

USER 10001:10001
VOLUME ["/var/lib/fedattn"]
# Prometheus /metrics and the progress check /healthz (200 while the edge makes progress,
# 503 when it is stuck).
EXPOSE 9101
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9101/healthz', timeout=4)"]
# fl-edge is PID 1: it handles SIGTERM (docker stop) itself, finishing its state writes and
# telling the server it leaves. Give it the time: docker stop -t 30.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fl-edge"]
# Add --server HOST:PORT and --name; mount the device's data at /data.
CMD ["--insecure", "--device", "cuda", "--data-dir", "/data", "--state-dir", "/var/lib/fedattn/edge", "--metrics-port", "9101"]
