# preheat image for GPU hosts. TORCH_INDEX selects the CUDA build of torch; the default
# image is CPU-only so that it also builds where no GPU is present.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# A C and C++ compiler: torch.compile builds its CPU kernels with them (Triton its launchers on CUDA), and
# preheat its bf16 kernel. Without one a worker's steps run eager, and `preheat workers` says why.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 preheat
COPY pyproject.toml README.md ./
COPY preheat ./preheat
COPY tasks ./tasks
COPY workers ./workers
COPY schedules ./schedules
COPY migrations ./migrations
RUN pip install ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH_SPEC" && pip install .
USER preheat
# The worker's health server: /health/live, /health/ready, /metrics (PREHEAT_HEALTH_PORT).
EXPOSE 9440
CMD ["preheat-worker", "--pool=threads", "--loglevel=INFO"]
