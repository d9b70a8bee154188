"""RayEngine: a VLLMEngine Ray actor seen as a plain engine object, every call bounded.

Weight updaters call engine methods synchronously (`engine.pause_generation(...)`). Wrap each
actor handle once and pass the wrappers instead of local engines:

    actors = [ray.remote(num_cpus=0)(VLLMEngine).remote(config, rank=i) for i in range(n)]
    engines = [RayEngine(actor, timeout_s=600) for actor in actors]
"""

from __future__ import annotations

from typing import Any


class RayEngine:
    """Forwards method calls to a Ray actor and waits for the result at most `timeout_s`."""

    def __init__(self, actor: Any, *, timeout_s: float = 600.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._actor = actor
        self._timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._actor, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            import ray

            ref = method.remote(*args, **kwargs)
            try:
                return ray.get(ref, timeout=self._timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                ray.cancel(ref)
                raise TimeoutError(
                    f"Ray engine actor: {name}() did not return within {self._timeout_s:g} s"
                ) from exc

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"RayEngine({self._actor!r})"
