"""Reports of memory snapshots and ledger reports, for ``metrale report`` and ``merge_reports``.

- `timeline`: a snapshot replayed as live bytes per call site; a Perfetto trace, a plot, an HTML timeline;
- `merge`: `LedgerReport` and `merge_reports` (many processes as one), `merge_snapshots`;
- `summary`: the tables the CLI prints of a snapshot, as text (the CLI hands in its table helper);
- `torch_snapshot`: snapshots as the pickle ``torch.cuda.memory._dump_snapshot`` writes, for pytorch.org/memory_viz.

``timeline`` and ``merge`` stand side by side; ``summary`` reads ``timeline``, ``torch_snapshot`` ``merge``.
None prints.
"""
