# fl-edge image for x86_64 GPU boxes. The PyPI torch wheel bundles the CUDA runtime, so a
# slim Python base is enough; the NVIDIA Container Toolkit mounts the driver at run time
# (`docker run --gpus all` / compose `deploy.resources.reservations.devices`).
#   docker build -f deploy/docker/edge-cuda.Dockerfile -t fedattn-edge-cuda .
# Private state (model, optimizer, identity) lives in the volume /var/lib/fedattn.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

RUN useradd --system --uid 10001 --create-home --home-dir /home/fedattn fedattn \
    && install -d -o fedattn -g fedattn /var/lib/fedattn
WORKDIR /opt/fedattn
COPY constraints.txt ./
RUN pip install --no-cache-dir -c constraints.txt torch torchvision
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY fl_server ./fl_server
COPY fl_edge ./fl_edge
COPY tools ./tools
COPY proto ./proto
RUN pip install --no-cache-dir -c constraints.txt .

USER 10001:10001
VOLUME ["/var/lib/fedattn"]
# Prometheus
EXPOSE 9101
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9101/metrics', timeout=4)"]
ENTRYPOINT ["fl-edge"]
# Add --server HOST:PORT and --name; mount the device's data at /data.
CMD ["--insecure", "--device", "cuda", "--data-dir", "/data", "--state-dir", "/var/lib/fedattn/edge", "--metrics-port", "9101"]
