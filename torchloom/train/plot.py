"""`torchloom plot`: loss and throughput curves of a run, from its metrics.jsonl, to a PNG."""

from __future__ import annotations

from pathlib import Path

from torchloom.config.errors import ConfigError
from torchloom.train.metrics import read_records


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass the --output.dir of a training run.")
    return read_records(path)


def plot_metrics(output_dir: Path) -> Path:
    """Draw loss (train and validation) and tokens/s against step into <output_dir>/metrics.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    train = [r for r in records if "loss" in r and r["loss"] is not None]
    val = [r for r in records if r.get("val_loss") is not None]
    if not train:
        raise ConfigError(f"{output_dir / 'metrics.jsonl'} holds no training steps yet.")
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax_loss.plot(
            [r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation"
        )
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_tps.plot([r["step"] for r in train], [r["tps"] for r in train])
    ax_tps.set(xlabel="step", ylabel="tokens/s per device", title="throughput")
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    png = output_dir / "metrics.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def plot_named(output_dir: Path, names: list[str]) -> Path:
    """Draw each named metric against step (one panel each) into
    <output_dir>/metrics-<names>.png; the records that have it, e.g. an RL run's held-out
    ``eval_pass@1`` every N updates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    missing = [n for n in names if not any(r.get(n) is not None for r in records)]
    if missing:
        known = sorted({k for r in records for k, v in r.items() if isinstance(v, int | float)})
        raise ConfigError(
            f"{output_dir / 'metrics.jsonl'} has no metric {', '.join(missing)}; it has "
            f"{', '.join(known)}."
        )
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in records if r.get(name) is not None]
        ax.plot([r["step"] for r in rows], [r[name] for r in rows], "o-")
        ax.set(xlabel="step", ylabel=name, title=name)
        ax.grid(alpha=0.3)
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    slug = "-".join("".join(c if c.isalnum() else "_" for c in n) for n in names)
    png = output_dir / f"metrics-{slug}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
