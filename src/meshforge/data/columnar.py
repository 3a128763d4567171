"""Parquet and Arrow sources (pyarrow, an optional extra): one document per row of a string column.

Parquet is how pretraining corpora ship (FineWeb, DCLM, The Stack); Arrow files are what a
Hugging Face ``datasets`` directory saved with ``save_to_disk`` holds. Both are read a batch
of rows at a time, so memory follows the batch, not the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from meshforge.data.sources import Source
from meshforge.errors import DataError

BATCH_ROWS = 1024


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading Parquet and Arrow files needs pyarrow: pip install 'meshforge[parquet]'") from None
    return pyarrow


class _Columnar:
    def __init__(self, src: Source, field: str):
        self.src, self.field = src, field
        self.pa = _pyarrow()
        self._rows_done, self._rows_total, self._pos = 0, 0, 0

    def consumed(self) -> int:
        return self.src.size * self._rows_done // max(1, self._rows_total)

    def _check_schema(self, schema: Any) -> None:
        if self.field not in schema.names:
            raise DataError(
                f"{self.src.path} has no column '{self.field}' (columns: {', '.join(schema.names)}); "
                "name the text column with --field"
            )
        t = schema.field(self.field).type
        types = self.pa.types
        if not (types.is_string(t) or types.is_large_string(t) or getattr(types, "is_string_view", bool)(t)):
            raise DataError(f"{self.src.path}: column '{self.field}' holds {t}, not text; name a string column")

    def records(self, skip: int = 0) -> Iterator[Iterable[str]]:
        try:
            for start, column in self._batches(skip):
                for j, value in enumerate(column.to_pylist()):
                    row = start + j
                    if row < skip:
                        continue
                    if value is None:
                        raise DataError(
                            f"{self.src.path} row {row}: '{self.field}' is null; drop or fill the empty rows"
                        )
                    self._rows_done = row + 1
                    yield (value,)
        except self.pa.ArrowException as e:
            raise DataError(f"{self.src.path} could not be read ({e}); is it truncated or damaged?") from None

    def _batches(self, skip: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError


class ParquetReader(_Columnar):
    def _batches(self, skip: int) -> Iterator[tuple[int, Any]]:
        pf = self.pa.parquet.ParquetFile(self.src.path)
        self._check_schema(pf.schema_arrow)
        meta = pf.metadata
        self._rows_total = meta.num_rows
        start, group = 0, 0
        while group < meta.num_row_groups and start + meta.row_group(group).num_rows <= skip:
            start += meta.row_group(group).num_rows
            group += 1
        self._rows_done = start
        groups = list(range(group, meta.num_row_groups))
        if not groups:
            return
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=[self.field]):
            yield start, batch.column(0)
            start += batch.num_rows


class ArrowReader(_Columnar):
    """An Arrow IPC file, stream format (as ``datasets`` writes it) or file format."""

    def consumed(self) -> int:
        return self._pos

    def _batches(self, skip: int) -> Iterator[tuple[int, Any]]:
        self._pos = 0
        with self.pa.memory_map(str(self.src.path)) as mm:
            try:
                reader = self.pa.ipc.open_stream(mm)
                batches = iter(reader)
            except self.pa.ArrowInvalid:
                mm.seek(0)
                reader = self.pa.ipc.open_file(mm)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            self._check_schema(reader.schema)
            start = 0
            for batch in batches:
                self._pos = mm.tell()  # (the file format reads by offset: its progress shows at the end)
                if start + batch.num_rows > skip:
                    yield start, batch.column(self.field)
                start += batch.num_rows
        self._pos = self.src.size
