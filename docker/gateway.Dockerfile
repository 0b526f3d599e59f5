# Gateway and scheduler image: FastAPI, redis and msgspec only, no torch.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 llmserve
WORKDIR /app
# Dependencies from pyproject.toml alone, before the source: an edit re-runs only the last two steps.
COPY pyproject.toml docker/requirements.py ./
RUN python requirements.py > requirements.txt && pip install -r requirements.txt 'setuptools>=68'
COPY README.md ./
COPY common common
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY llmserve llmserve
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info
USER 10001
EXPOSE 8000
CMD ["llmserve", "gateway"]
