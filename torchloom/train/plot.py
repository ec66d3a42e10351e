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


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _curve(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    """The steps and values of the records whose ``name`` is a number (a string or a null is
    skipped)."""
    rows = [r for r in records if _numeric(r.get(name))]
    return [r["step"] for r in rows], [r[name] for r in rows]


def plot_metrics(output_dir: Path) -> Path:
    """Draw loss (train and validation) and tokens/s against step into <output_dir>/metrics.png;
    a curve the records lack is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    train, val, tps = (_curve(records, name) for name in ("loss", "val_loss", "tps"))
    panels = (["loss"] if train[0] or val[0] else []) + (["tps"] if tps[0] else [])
    if not panels:
        raise ConfigError(
            f"{output_dir / 'metrics.jsonl'} holds no numeric loss, val_loss or tps to plot; "
            "train a step first, or plot another metric with --metric NAME."
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "loss":
            if train[0]:
                ax.plot(*train, label="train")
            if val[0]:
                ax.plot(*val, "o-", label="validation")
            ax.set(xlabel="step", ylabel="loss", title="loss")
            ax.legend()
        else:
            ax.plot(*tps)
            ax.set(xlabel="step", ylabel="tokens/s per device", title="throughput")
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
    missing = [n for n in names if not _curve(records, n)[0]]
    if missing:
        known = sorted({k for r in records for k, v in r.items() if _numeric(v)} - {"step"})
        raise ConfigError(
            f"{output_dir / 'metrics.jsonl'} has no metric {', '.join(missing)}; it has "
            f"{', '.join(known)}."
        )
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        ax.plot(*_curve(records, name), "o-")
        ax.set(xlabel="step", ylabel=name, title=name)
        ax.grid(alpha=0.3)
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    slug = "-".join("".join(c if c.isalnum() else "_" for c in n) for n in names)
    png = output_dir / f"metrics-{slug}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
