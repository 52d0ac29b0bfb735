"""The demos' data, written with no Lightning, torch or model imported: the tabular demo table,
the image folder and the token corpus. A script that only needs a demo table (and the
DataLoader workers that import that script again) stays light.

The corpus follows a fixed rule so a model can learn it: each token is followed by
``(3 * token + 1) % vocabulary`` most of the time, else by a random token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image as PILImage

from spiral_lightning.core.spec import TableSpec
from spiral_lightning.sources.spiral import IDS_FILE
from spiral_lightning.sources.write import write_table

#: Features per row and classes of the demo task.
FEATURES = 16
CLASSES = 4


def demo_data(rows: int, seed: int = 0) -> pa.Table:
    """``rows`` rows of ``id``, ``features`` (16 float32) and ``label``: the class whose fixed
    random direction is closest to the features, so a linear model can learn it."""
    generator = np.random.default_rng(seed)
    directions = generator.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    features = generator.standard_normal((rows, FEATURES)).astype(np.float32)
    labels = (features @ directions).argmax(axis=1).astype(np.int64)
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), FEATURES),
            "label": pa.array(labels),
        }
    )


def demo_table(root: str | Path, rows: int = 200_000, split_rows: int = 20_000) -> TableSpec:
    """The demo table at ``root``, written there first when the folder holds none."""
    root = Path(root)
    if not (root / IDS_FILE).exists():
        write_table(f"spiral:{root}", demo_data(rows), split_rows=split_rows)
    return TableSpec(f"spiral:{root}").resolve()


#: Each class is a dominant colour; the images add noise and a random patch of another colour.
COLOURS = {"red": (200, 40, 40), "green": (40, 190, 60), "blue": (40, 60, 200), "yellow": (210, 200, 40)}


def demo_image_folder(root: str | Path, per_class: int = 96, seed: int = 0) -> Path:
    """A class-per-subfolder folder of JPEGs at ``root`` (written when missing): ``per_class``
    images of each colour class, a fifth of them named ``val-*`` and the rest ``train-*``."""
    root = Path(root)
    if root.is_dir() and any(root.iterdir()):
        return root
    generator = np.random.default_rng(seed)
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for number in range(per_class):
            width, height = generator.integers(40, 80, 2)
            pixels = np.clip(np.array(colour) + generator.normal(0, 30, (height, width, 3)), 0, 255)
            top, left = generator.integers(0, height // 2), generator.integers(0, width // 2)
            pixels[top : top + height // 3, left : left + width // 3] = generator.integers(0, 255, 3)
            split = "val" if number % 5 == 0 else "train"
            PILImage.fromarray(pixels.astype(np.uint8)).save(root / name / f"{split}-{number:04d}.jpg", quality=90)
    return root


#: Token ids of the demo corpus are ``1..VOCABULARY - 1``; 0 separates documents.
VOCABULARY = 512
SEPARATOR = 0
#: The column that holds each document's token ids.
TOKENS = "tokens"


def corpus(documents: int, seed: int = 0) -> pa.Table:
    """``documents`` documents of 1 to 300 token ids following the corpus's rule."""
    generator = np.random.default_rng(seed)
    lengths = generator.integers(1, 301, documents)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tokens = np.empty(int(lengths.sum()), dtype=np.int64)
    tokens[starts] = generator.integers(1, VOCABULARY, documents)
    # Position by position across every document still that long.
    for step in range(1, int(lengths.max())):
        at = starts[lengths > step] + step
        follows = tokens[at - 1] * 3 % (VOCABULARY - 1) + 1
        noisy = generator.random(at.size) < 0.1
        tokens[at] = np.where(noisy, generator.integers(1, VOCABULARY, at.size), follows)
    offsets = np.concatenate((starts, [tokens.size])).astype(np.int32)
    return pa.table({TOKENS: pa.ListArray.from_arrays(offsets, pa.array(tokens.astype(np.int32)))})


def corpus_tables(root: str | Path, documents: int = 4_000, split_rows: int = 500) -> tuple[TableSpec, TableSpec]:
    """The train and validation corpora under ``root`` (``train``, ``val``: a tenth as many
    documents, another seed), written there first when missing."""
    specs = []
    for name, count, seed in (("train", documents, 0), ("val", max(1, documents // 10), 1)):
        folder = Path(root) / name
        if not (folder / IDS_FILE).exists():
            write_table(f"spiral:{folder}", corpus(count, seed), split_rows=split_rows)
        specs.append(TableSpec(f"spiral:{folder}"))
    return specs[0], specs[1]
