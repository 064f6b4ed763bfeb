"""The Dockerfile builds the image the KubeRay manifest runs (no Docker daemon here: the
file is checked as text against the manifest, pyproject.toml and docs/deployment.md)."""

import fnmatch
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MANIFEST = yaml.safe_load((ROOT / "cluster" / "kuberay-rayservice.yaml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def arg_defaults() -> dict[str, str]:
    """Each ARG's default (an ARG re-declared after FROM without one keeps it)."""
    out: dict[str, str] = {}
    for word, rest in instructions():
        name, eq, value = rest.partition("=")
        if word == "ARG" and eq:
            out[name] = value
    return out


def build_commands(text: str) -> list[list[str]]:
    """Every `docker build ...` command written in ``text`` (comments and code blocks)."""
    return [shlex.split(m) for m in re.findall(r"docker build [^\n#`]*", text)]


def manifest_images() -> set[str]:
    cluster = MANIFEST["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    return {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]}


def test_torch_is_the_cpu_wheel_by_default_with_a_build_arg_for_cuda():
    args = arg_defaults()
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert args["TORCH_VERSION"] == pin == "2.13.0"
    (torch_install,) = [r for w, r in instructions() if w == "RUN" and "torch==" in r]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_install


def test_base_image_is_the_manifests_ray_version():
    args = arg_defaults()
    (base,) = [r for w, r in instructions() if w == "FROM"]
    assert base.startswith("rayproject/ray:${RAY_VERSION}")
    assert args["RAY_VERSION"] == MANIFEST["spec"]["rayClusterConfig"]["rayVersion"]


def test_project_models_and_cluster_configs_are_in_the_image():
    copied = {
        path
        for word, rest in instructions()
        if word == "COPY"
        for path in rest.split()[:-1]
        if not path.startswith("--")
    }
    # Every package pyproject.toml installs (a package left out fails the image's import
    # check at the end of its build).
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    assert {"pyproject.toml", "models", "cluster", *packages} <= copied, packages - copied
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in ignored
    for path in copied:
        assert (ROOT / path).exists(), path
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), path
    editable = re.compile(r"-e ['\"]?\.(\[[a-z,]+\])?['\"]?(\s|$)")  # the checkout, extras or not
    assert any(w == "RUN" and "pip install" in r and editable.search(r) for w, r in instructions())


def test_manifest_names_the_image_the_documented_build_tags():
    (image,) = manifest_images()
    for text in (DOCKERFILE, (ROOT / "docs" / "deployment.md").read_text()):
        tagged = {cmd[cmd.index("-t") + 1]: cmd for cmd in build_commands(text) if "-t" in cmd}
        assert image in tagged, (image, tagged)
        # The manifest's pods have GPUs: its image is built with a CUDA torch.
        cmd = tagged[image]
        assert any(arg.startswith("TORCH_VARIANT=cu") for arg in cmd), cmd
