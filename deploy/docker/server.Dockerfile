# fl-server image (CPU: the server aggregates, it does not train).
#   docker build -f deploy/docker/server.Dockerfile -t fedattn-server .
# Checkpoints and history.json live in the volume /var/lib/fedattn; --resume continues a run.
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=2

RUN useradd --system --uid 10001 --create-home --home-dir /home/fedattn fedattn \
    && install -d -o fedattn -g fedattn /var/lib/fedattn
WORKDIR /opt/fedattn
COPY constraints.txt ./
# torch first, from the CPU wheel index, pinned by constraints.txt like `make setup`.
RUN pip install --no-cache-dir -c constraints.txt --index-url "${TORCH_INDEX}" torch torchvision
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY fl_server ./fl_server
COPY fl_edge ./fl_edge
COPY tools ./tools
COPY proto ./proto
# [server]: numba, the compiled loops of the exact sum and the upload scan (shared/kernels.py);
# their machine code is cached under the user's home (~/.cache/numba) on first use.
RUN pip install --no-cache-dir -c constraints.txt '.[server]'

USER 10001:10001
VOLUME ["/var/lib/fedattn"]
# gRPC, Prometheus
EXPOSE 50051 9100
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=4).status; sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["fl-server"]
# TLS: replace --insecure with the certificate flags once TLS lands (README, Deployment).
CMD ["--insecure", "--port", "50051", "--metrics-port", "9100", "--checkpoint-dir", "/var/lib/fedattn/server"]
