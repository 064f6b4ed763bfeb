# The SpecServe image: Ray + Ray Serve, the project, the demo pair and the cluster configs.
#
#   docker build -t specserve:0.1.0 .                                      # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu128 -t specserve:0.1.0-gpu .  # CUDA torch
#
# cluster/kuberay-rayservice.yaml runs `specserve:0.1.0-gpu` (push it to a registry your
# Kubernetes cluster pulls from and put that name in the manifest). TORCH_VARIANT names a
# PyTorch wheel index, https://download.pytorch.org/whl/<variant>: `cpu` (default) or the
# CUDA build that matches your nodes' driver (cu126, cu128, cu130, ...); the CUDA runtime
# comes with the wheel, the driver from the node.

ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
# An official Ray image: the Ray version of the manifest (rayVersion) and the tools KubeRay
# expects in its containers.
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}

ARG RAY_VERSION
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

# torch first, from the chosen index, so that installing the project (which pins
# torch==2.13.0) keeps it instead of pulling the default CUDA wheel from PyPI.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /home/ray/specserve
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users specdec specdec
COPY --chown=ray:users deployments deployments
COPY --chown=ray:users monitoring monitoring
COPY --chown=ray:users adaptation adaptation
COPY --chown=ray:users models models
COPY --chown=ray:users cluster cluster
# Editable, so that relative model paths (models/demo-target) resolve against this checkout
# from any Ray worker's working directory (deployments.config.resolve_model_path). With
# peft: adaptation trains low-rank adapters for drafts of adapter_min_params and more.
RUN pip install --no-cache-dir -e ".[adapters]" "ray[serve]==${RAY_VERSION}" \
    && python -c "import torch, transformers, ray, specdec, deployments.app, monitoring, peft"
