"""Print the ``uv pip install`` options that give uv the package sources pip is configured with.

    uv pip install $(python scripts/uv_args.py) ...

uv does not read pip's configuration (``pip.conf``, ``PIP_*``), so on a machine whose wheels come
from local folders and indexes (``find-links``, ``extra-index-url``, ``constraint``) uv would look
on PyPI alone, and torch's CPU wheel would become its CUDA build. This reads ``pip config list``
and prints the same sources as uv options, plus pip's own way of choosing among indexes (the best
version from any of them). Standard library only: it runs before the virtual environment exists.
It installs nothing.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

OPTIONS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
           "constraint": "--constraint"}  # fmt: skip


def uv_args(pip_config: str) -> list[str]:
    """``pip config list`` output (``scope.key='value'`` lines) as uv options, each value once."""
    args = ["--index-strategy", "unsafe-best-match"]
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name == "cert" and "--native-tls" not in args:  # pip's CA bundle: use the system's store
            args.append("--native-tls")
        elif name in OPTIONS:
            for part in " ".join(shlex.split(value)).split():
                if not any(args[i] == OPTIONS[name] and args[i + 1] == part for i in range(len(args) - 1)):
                    args += [OPTIONS[name], part]
    return args


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    print(shlex.join(uv_args(listed.stdout)))
