"""The multi-node trainer manifest (``infra/k8s/multinode-trainer.yaml``) rendered as ``envsubst``
renders it for ``kubectl``, with the values of one 2-node stage: shared by ``test_infra.py`` and
``test_k8s_manifest.py``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"

MULTINODE_VALUES = {
    "NAME": "sft-run42", "NAMESPACE": "posttrain", "NNODES": "2", "NPROC_PER_NODE": "8",
    "IMAGE": "registry.example.com/posttrain-worker:1.2", "SPEC_URI": "s3://b/runs/run42/specs/sft.json",
}  # fmt: skip


def envsubst(text: str, values: dict[str, str]) -> str:
    """GNU ``envsubst`` without arguments: ``$VAR`` and ``${VAR}`` replaced, unset ones by ''."""
    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", lambda m: values.get(m.group(1) or m.group(2), ""), text)


def render_multinode(values: dict[str, str]) -> tuple[dict, dict]:
    template = (INFRA / "k8s" / "multinode-trainer.yaml").read_text()
    text = envsubst(template, values)
    if envsubst_bin := shutil.which("envsubst"):  # the real tool, where installed, renders the same
        real = subprocess.run([envsubst_bin], input=template, capture_output=True, text=True, env=values, check=True)
        assert real.stdout == text
    service, job = yaml.safe_load_all(text)
    return service, job
