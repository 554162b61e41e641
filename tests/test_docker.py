"""docker/Dockerfile, checked without Docker (no image is built here): it copies every package
the served models import, every `python -m` it runs names a module that runs, and its edit of
the serving model's config takes effect. The same check of `python -m` holds for the
Makefile, the README and the docs."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from orca_backend.serving.launch import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "docker" / "Dockerfile").read_text()


def test_the_image_copies_every_package_the_models_import():
    copied = set(re.findall(r"^COPY (\S+) \./\1$", DOCKERFILE, re.M))
    for name in copied:
        assert (REPO_ROOT / name).exists(), name
    imported = set()
    sources = [*REPO_ROOT.glob("model_repository/*/1/model.py"), *REPO_ROOT.glob("orca_backend/**/*.py")]
    assert len(sources) > 40, "the scan no longer sees the package's modules"
    for path in sources:
        imported |= set(re.findall(r"^\s*(?:from|import) (orca_backend|trt_plugins|client)\b", path.read_text(), re.M))
    assert imported <= copied, f"imported but not copied: {imported - copied}"


def runnable(module: str) -> bool:
    """Whether `python -m module` runs something of ours: a module with a __main__ block, or a
    package with a __main__.py."""
    path = REPO_ROOT.joinpath(*module.split("."))
    if (path / "__main__.py").exists():
        return True
    source = path.with_suffix(".py")
    return source.exists() and re.search(r"^if __name__ == .__main__.:", source.read_text(), re.M) is not None


def python_m_modules(text: str) -> set[str]:
    """Our modules that `python -m` (or `$(PY) -m`) runs in a text: in shell form, or in a
    Dockerfile's JSON form."""
    ours = r"((?:orca_backend|trt_plugins|client|tools|benchmarks)(?:\.\w+)*)"
    return set(re.findall(rf"\s-m {ours}", text)) | set(re.findall(rf'"-m", "{ours}"', text))


@pytest.mark.parametrize("path", ["docker/Dockerfile", "Makefile", "README.md", *sorted(
    str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("docs/**/*.md"))])
def test_every_python_m_names_a_module_that_runs(path):
    modules = python_m_modules((REPO_ROOT / path).read_text())
    if path in ("docker/Dockerfile", "Makefile"):
        assert modules, f"{path} runs none of our modules: the scan is broken"
    assert not [m for m in modules if not runnable(m)], f"{path} runs modules without a main"


def test_the_check_of_python_m_sees_a_module_without_a_main():
    assert runnable("orca_backend.checkpoint.prepare") and runnable("tools.gpu_check")
    assert not runnable("orca_backend.checkpoint.store") and not runnable("orca_backend.nothing")
    assert python_m_modules("RUN python3 -m orca_backend.checkpoint.store && x\n"
                            'CMD ["python3", "-m", "orca_backend.launch"]') == {
        "orca_backend.checkpoint.store", "orca_backend.launch"}


def test_the_image_prepares_the_default_model():
    assert re.search(r"^RUN python3 -m orca_backend\.checkpoint\.prepare\b", DOCKERFILE, re.M)


@pytest.mark.parametrize("engine", ["torch", "tensorrt"])
def test_the_images_config_edit_takes_effect(tmp_path, engine):
    """The RUN step's sed and grep checks, on a copy of the repository's config."""
    step = re.search(r"(sed -i .*?config\.pbtxt && \\\n.*?config\.pbtxt && \\\n.*?config\.pbtxt)\n",
                     DOCKERFILE, re.S)
    assert step, "the config edit step moved; update this test"
    shutil.copytree(REPO_ROOT / "model_repository" / "orca", tmp_path / "model_repository" / "orca")
    subprocess.run(["sh", "-c", step.group(1).replace("\\\n", " ")], cwd=tmp_path, check=True,
                   env={"ENGINE": engine, "PATH": "/usr/bin:/bin"})
    config = (tmp_path / "model_repository" / "orca" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]" in config
    assert f'parameters: {{ key: "engine" value: {{ string_value: "{engine}" }} }}' in config
