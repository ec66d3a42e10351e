"""`torchloom plot`: loss and throughput curves of a run, from its metrics.jsonl, to a PNG."""

from __future__ import annotations

from pathlib import Path

from torchloom.config.errors import ConfigError
from torchloom.train.metrics import read_records


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a run's metrics file; pass the --output.dir "
                          "of a training run.")  # fmt: skip
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass the --output.dir of a training run.")
    try:
        return read_records(path)
    except OSError as err:
        raise ConfigError(f"Cannot read {path}: {err.strerror}; make it readable.") from None


def _save(fig, output_dir: Path, png: Path) -> Path:
    """Title, lay out and write ``fig`` to ``png``; one ConfigError if it cannot be written."""
    import matplotlib.pyplot as plt

    fig.suptitle(str(output_dir))
    fig.tight_layout()
    try:
        if png.is_dir():
            raise IsADirectoryError(21, "it is a folder")
        fig.savefig(png, dpi=100)
    except OSError as err:
        raise ConfigError(
            f"Cannot write {png} ({err.strerror}); move it away or make {output_dir} writable, "
            "or copy metrics.jsonl into a writable folder and plot that."
        ) from None
    finally:
        plt.close(fig)
    return png


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
    return _save(fig, output_dir, output_dir / "metrics.png")


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
    slug = "-".join("".join(c if c.isalnum() else "_" for c in n) for n in names)
    return _save(fig, output_dir, output_dir / f"metrics-{slug}.png")
