"""Where conversations come from: data files, folders of them and Hub dataset ids, read with `datasets`.

JSON lists, JSON Lines (plain or gzip-compressed) and parquet are read by `datasets.load_dataset` from local files
only, so an offline run never tries the network; a folder contributes every such file directly in it, in name order
(hidden and temporary files, such as a shard still being written, are skipped). One case `datasets` cannot read is
kept: a JSON list that is cut off mid-record (the ShareGPT dump), read up to its last whole record. Parsing the
records into conversations is `eagle3_hf.training.data`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator

from datasets import Dataset

logger = logging.getLogger("eagle3_hf.training.data")  # one logger for reading and parsing the data

# File name endings read -> the `datasets` builder for them.
DATA_SUFFIXES = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
}

__all__ = ["DATA_SUFFIXES", "is_dataset_id", "not_utf8_error", "read_records"]


def _iter_json_list(text: str, path: str) -> Iterator[object]:
    """Yield the records of a JSON list one by one, stopping (with a warning) where the file is cut off.

    Only for a list that does not close (the ShareGPT dump is cut off mid-record), which `datasets` cannot read.
    """
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    position = separators.match(text, text.index("[") + 1).end()
    count = 0
    while position < len(text) and text[position] != "]":
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            logger.warning(
                "%s stops being valid JSON at character %d of %d; kept the %d whole records before it.",
                path,
                position,
                len(text),
                count,
            )
            return
        count += 1
        yield record
        position = separators.match(text, position).end()


def _builder(path: str) -> str | None:
    """The `datasets` builder that reads `path` ("json" or "parquet"), or None for another kind of file."""
    name = path.lower()
    return next((builder for suffix, builder in DATA_SUFFIXES.items() if name.endswith(suffix)), None)


def _is_cut_off_json_list(path: str) -> bool:
    """A .json file that opens a list and never closes it (read record by record instead)."""
    if not path.lower().endswith(".json"):
        return False
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
        f.seek(max(0, os.path.getsize(path) - 64))
        tail = f.read().rstrip()
    return head.startswith(b"[") and not tail.endswith(b"]")


def _read_text(path: str) -> str:
    """The text of a (gzip-compressed) UTF-8 file; a byte that is not UTF-8 is named with its line."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"{path} line {line} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "save the file as UTF-8."
        ) from err


def _check_json_file(path: str) -> None:
    """Say what is wrong with a JSON / JSON Lines file that `datasets` could not read (naming the line)."""
    text = _read_text(path)
    stripped = text.lstrip()
    if not stripped.startswith(("[", "{")):
        raise ValueError(f"{path} does not hold JSON records (it starts with {stripped[:20]!r}).")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as error:
        if stripped.startswith("["):
            raise ValueError(f"{path} is not valid JSON: {error}") from error
        whole = None
    if isinstance(whole, dict):
        raise ValueError(
            f"{path} holds one JSON object with keys {sorted(whole)}, not records; expected a JSON list or JSON Lines."
        )
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip() and whole is None:
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {line_no} is not valid JSON: {error}") from error


def _load_files(paths: list[str], where: str) -> Dataset:
    """Local data files (one builder) as one `Dataset`, with `datasets.load_dataset`; never touches the network."""
    from datasets import load_dataset

    builders = {_builder(p) for p in paths}
    if len(builders) != 1:
        raise ValueError(f"{where} mixes JSON and parquet files; keep one format per folder.")
    try:
        dataset = load_dataset(builders.pop(), data_files=paths, split="train")
    except Exception as error:  # datasets wraps parser errors in its own types: say which file, and what is wrong
        for path in paths:
            if _builder(path) == "json":
                _check_json_file(path)
        raise ValueError(f"Could not read {where} with datasets: {' '.join(str(error).split())}") from error
    if dataset.column_names == ["text"]:  # how datasets reads a JSON list of numbers or strings
        for path in paths:
            _check_records_are_objects(path)
    return dataset


def _check_records_are_objects(path: str) -> None:
    """Refuse a JSON (Lines) file whose first record is not a JSON object (`[1, 2, 3]`), naming what it is."""
    if _builder(path) != "json":
        return
    text = _read_text(path).lstrip()
    try:
        records = json.loads(text) if text.startswith("[") else [json.loads(text.splitlines()[0])] if text else []
    except json.JSONDecodeError:
        return  # a record that spans lines: datasets read it, so it is an object
    if records and not isinstance(records[0], dict):
        raise ValueError(
            f"{path}: record 0 is {json.dumps(records[0])[:40]} (a JSON {type(records[0]).__name__}); "
            "expected each record to be a JSON object (a ShareGPT, messages or Alpaca record)."
        )


def _data_files(folder: str) -> list[str]:
    """The data files directly in `folder`, in name order, skipping hidden and temporary ones (``.x.tmp``)."""
    names = sorted(n for n in os.listdir(folder) if not n.startswith((".", "~")) and _builder(n) is not None)
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def _hub_dataset(name: str) -> Dataset:
    from datasets import load_dataset

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise ValueError(
            f"No such file or folder: {name!r} (and the Hub is offline, so it is not loaded as a dataset id either)."
        )
    try:
        return load_dataset(name, split="train")
    except Exception as error:
        raise ValueError(
            f"{name!r} is not a local file or folder, and loading it as a Hub dataset failed: "
            f"{' '.join(str(error).split())}"
        ) from error


def not_utf8_error(path: str, error: UnicodeDecodeError) -> ValueError:
    """The error to raise when reading the records of `path` (a file or folder) met text that is not UTF-8:
    `datasets` reads such bytes into its tables without a word and fails only when a row is read, naming no file."""
    for file in _data_files(path) if os.path.isdir(path) else [path]:
        if _builder(file) == "json":
            try:
                _read_text(file)
            except ValueError as named:
                return named
    return ValueError(f"{path} holds text that is not UTF-8 ({error}); save it as UTF-8.")


def read_records(path: str) -> Iterable:
    """The records of a file, a folder of files, or a Hub dataset id."""
    if os.path.isdir(path):
        files = _data_files(path)
        if not files:
            raise ValueError(f"The folder {path!r} holds no data files ({', '.join(DATA_SUFFIXES)}).")
        return _load_files(files, f"the files in {path!r}")
    if os.path.isfile(path):
        if _builder(path) is None:
            raise ValueError(f"Cannot read {path!r}: expected a {', '.join(DATA_SUFFIXES)} file or a folder of them.")
        if _is_cut_off_json_list(path):
            return _iter_json_list(_read_text(path), path)
        return _load_files([path], repr(path))
    if is_dataset_id(path):
        return _hub_dataset(path)
    raise ValueError(f"No such file or folder: {path!r}.")


def is_dataset_id(name: str) -> bool:
    """Whether `name` reads as a Hub dataset id (``org/name``, not a path or a file name with a data suffix)."""
    return (
        name.count("/") == 1
        and not name.startswith((".", "/", "~"))
        and _builder(name) is None
        and re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None
    )
