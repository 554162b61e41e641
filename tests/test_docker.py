"""docker/Dockerfile, checked without Docker (no image is built here): it copies every package
the served models import, and its edit of the serving model's config takes effect."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from orca_backend.launch import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "docker" / "Dockerfile").read_text()


def test_the_image_copies_every_package_the_models_import():
    copied = set(re.findall(r"^COPY (\S+) \./\1$", DOCKERFILE, re.M))
    for name in copied:
        assert (REPO_ROOT / name).exists(), name
    imported = set()
    for path in [*REPO_ROOT.glob("model_repository/*/1/model.py"), *REPO_ROOT.glob("orca_backend/*.py")]:
        imported |= set(re.findall(r"^\s*(?:from|import) (orca_backend|trt_plugins|client)\b", path.read_text(), re.M))
    assert imported <= copied, f"imported but not copied: {imported - copied}"


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
