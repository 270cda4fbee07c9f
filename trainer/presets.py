"""Model sizes: a torch-free module, so that the CLI starts without importing torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab_size: int = 256  # byte-level
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be divisible by n_heads")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("ModelConfig: head dimension dim/n_heads must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes. `tiny` trains on a CPU in seconds; the others are for GPUs.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=192, max_seq_len=64),
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, ffn_dim=704, max_seq_len=256),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=1024),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, max_seq_len=2048),
}
