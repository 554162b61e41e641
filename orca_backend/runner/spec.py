"""What a runner is built from: the engine's option parts as they are, and what the engine
worked out from them (the checkpoint's folder, the K/V pool's size, the context limit, where
built engines are kept, a pipeline stage's layers). Plain values on the wire: it crosses to
child processes and to the Triton stage models as `to_values()`, `RunnerSpec(**values)` back."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..core.config import CacheConfig, EngineConfig, ParallelConfig, RunnerConfig, SchedulerConfig

_PARTS = {"runner": RunnerConfig, "scheduler": SchedulerConfig, "cache": CacheConfig, "parallel": ParallelConfig}
START_MARGIN_SECONDS = 60  # a child's own watch names its stage before its parent gives up on it


@dataclass(slots=True)
class RunnerSpec:
    model_path: str
    num_blocks: int
    max_model_len: int = 2048  # sets the graphs' block-table width and the engines' profile
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    layer_range: tuple[int, int] | None = None  # a pipeline stage's layers [start, stop); None: all
    engine_cache_dir: str = ""  # where built TensorRT engines are kept

    def __post_init__(self) -> None:
        for name, part in _PARTS.items():  # mappings, after a trip through msgpack or JSON
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, part(**value))
        if self.layer_range is not None:
            self.layer_range = tuple(self.layer_range)

    @classmethod
    def from_config(cls, config: EngineConfig, *, model_path: Path | str, num_blocks: int,
                    max_model_len: int, engine_cache_dir: str = "") -> RunnerSpec:
        """The runner of a whole model, as `config` asks for it."""
        return cls(str(model_path), num_blocks, max_model_len, config.runner, config.scheduler, config.cache,
                   config.parallel, engine_cache_dir=engine_cache_dir)

    def to_values(self) -> dict:
        return asdict(self)

    def on(self, device: str, layer_range: tuple[int, int] | None) -> RunnerSpec:
        """The same runner on another device, or as a pipeline stage."""
        return replace(self, runner=replace(self.runner, device=device), layer_range=layer_range)

    @property
    def child_start_timeout_seconds(self) -> float:
        """How long a parent waits for a child (a runner process, a rank) to load: past the
        child's own load_timeout_seconds, so that the child reports the stage it hung in."""
        return self.runner.load_timeout_seconds + START_MARGIN_SECONDS

    @property
    def collective_timeout_seconds(self) -> float:
        """Under the engine's deadline, so that a hung rank is named before the runner is."""
        return max(1.0, self.parallel.iteration_timeout_seconds / 2)
