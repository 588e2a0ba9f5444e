"""Documents from a Hugging Face `datasets` dataset (`dataset_type=hf`), one row = one document.

`hf_path` is either a directory (local or gs://) written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or the
name of one of the library's packaged builders of tabular files (`TEXT_BUILDERS`) that reads the
files `hf_data_files` matches, local or gs:// (the library fetches URLs through fsspec, whose gcsfs honours
STORAGE_EMULATOR_HOST, into its download cache). Nothing else is accepted: a hub name would need the
hub, which a run never asks, so it is refused with what to do instead. Rows are read by index
from the Arrow table on demand, so the same lanes, packing, shuffling and eval split as text files
apply (text.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from maxpar.core import storage
from maxpar.core.config import Config, ConfigError
from maxpar.io.data.errors import reading
from maxpar.io.data.records import Record
from maxpar.io.data.text import resolve_files

TEXT_BUILDERS = ("arrow", "csv", "json", "parquet", "text")  # the `datasets` packaged builders of tabular files


class HfTexts(Sequence[str]):
    """The `field` column of a `datasets.Dataset`."""

    def __init__(self, dataset: Any, field: str, where: str):
        if field not in dataset.column_names:
            raise ConfigError(f"dataset_text_field={field!r}: {where} has no such column; its columns: "
                              f"{', '.join(dataset.column_names)}")
        self._column = dataset.select_columns([field])
        self._field = field
        self._where = where
        if len(self):
            self[0]  # a column that is not text is reported now, not hours into training

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        with reading("dataset_type=hf", f"{self._where}, row {index}"):
            text = self._column[int(index)][self._field]
        if isinstance(text, bytes):
            return text.decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise ConfigError(f"dataset_text_field={self._field!r}: {self._where}, row {index} holds a "
                              f"{type(text).__name__}, not text")
        return text


class HfRecords(Sequence[Record]):
    """Every row of a `datasets.Dataset` as a whole dict (a post-training conversation or pair)."""

    def __init__(self, dataset: Any, where: str):
        self._dataset = dataset
        self._where = where

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Record:  # type: ignore[override]
        where = f"{self._where}, row {index}"
        with reading("dataset_type=hf", where):
            return Record(dict(self._dataset[int(index)]), where)


def open_hf_records(config: Config) -> tuple[HfRecords, HfRecords | None]:
    """(training rows, the named eval split's rows or None) of the config's `hf_*` keys, as whole records."""
    splits = _load(config)
    where = f"hf_path={config.hf_path!r}"
    if not isinstance(splits, dict):
        if config.hf_eval_split:
            raise ConfigError(f"hf_eval_split={config.hf_eval_split!r}: {where} is a single dataset without splits; "
                              f"set hf_eval_split='' to hold out eval_fraction of its rows")
        return HfRecords(splits, where), None
    for key, name in (("hf_train_split", config.hf_train_split), ("hf_eval_split", config.hf_eval_split)):
        if name and name not in splits:
            raise ConfigError(f"{key}={name!r}: {where} has no such split; its splits: {', '.join(splits)}")
    train = HfRecords(splits[config.hf_train_split], f"{where}, split {config.hf_train_split!r}")
    named_eval = config.hf_eval_split
    return train, HfRecords(splits[named_eval], f"{where}, split {named_eval!r}") if named_eval else None


def open_hf(config: Config) -> tuple[HfTexts, HfTexts | None]:
    """(training documents, the named eval split's documents or None) of the config's `hf_*` keys."""
    splits = _load(config)
    where = f"hf_path={config.hf_path!r}"
    if not isinstance(splits, dict):  # a single Dataset saved to disk: no named splits
        if config.hf_eval_split:
            raise ConfigError(f"hf_eval_split={config.hf_eval_split!r}: {where} is a single dataset without splits; "
                              f"set hf_eval_split='' to hold out eval_fraction of its rows")
        return _texts(splits, config, where), None

    def split(key: str, name: str) -> HfTexts:
        if name not in splits:
            raise ConfigError(f"{key}={name!r}: {where} has no such split; its splits: {', '.join(splits)}")
        return _texts(splits[name], config, f"{where}, split {name!r}")

    train = split("hf_train_split", config.hf_train_split)
    return train, split("hf_eval_split", config.hf_eval_split) if config.hf_eval_split else None


def _texts(dataset: Any, config: Config, where: str) -> HfTexts:
    texts = HfTexts(dataset, config.dataset_text_field, where)
    if not len(texts):
        raise ConfigError(f"{where} holds no rows")
    return texts


def _load(config: Config) -> Any:
    """The dataset (a Dataset, or a dict of split name -> Dataset), read without the hub."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("dataset_type=hf needs the `datasets` package: pip install -e '.[hf]'") from None
    path = storage.path(config.hf_path)  # a save_to_disk directory may be local or gs://
    if path.is_dir():
        if config.hf_data_files:
            raise ConfigError(f"hf_data_files={config.hf_data_files!r}: set it only with a builder as hf_path "
                              f"({', '.join(TEXT_BUILDERS)}), not with the directory hf_path={config.hf_path!r}")
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ConfigError(f"hf_path={config.hf_path!r}: not a dataset written by save_to_disk: {e}") from None
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else loaded
    if config.hf_path not in TEXT_BUILDERS:
        raise ConfigError(f"hf_path={config.hf_path!r}: neither a local directory written by save_to_disk nor a "
                          f"builder of data files ({', '.join(TEXT_BUILDERS)}); maxpar reads datasets offline, "
                          f"so for a hub dataset run `datasets.load_dataset(NAME).save_to_disk(DIR)` where the "
                          f"hub is reachable and set hf_path=DIR")
    if not config.hf_data_files:
        raise ConfigError(f"hf_path={config.hf_path!r} (a builder) needs hf_data_files: a glob of files")
    try:
        files = resolve_files(config.hf_data_files)
    except ValueError as e:
        raise ConfigError(f"hf_data_files={config.hf_data_files!r}: {e}") from None
    try:
        loaded = datasets.load_dataset(config.hf_path, data_files={config.hf_train_split: files},
                                       download_config=datasets.DownloadConfig(local_files_only=True))
    except Exception as e:  # the builders raise many kinds (ArrowInvalid, DatasetGenerationError, ...)
        raise ConfigError(f"hf_path={config.hf_path!r} with hf_data_files={config.hf_data_files!r}: cannot read "
                          f"them: {type(e).__name__}: {e}") from None
    return dict(loaded)
