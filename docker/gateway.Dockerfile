# Gateway and scheduler image: FastAPI, redis and msgspec only, no torch.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common common
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY llmserve llmserve
RUN pip install --no-cache-dir .
EXPOSE 8000
CMD ["llmserve", "gateway"]
