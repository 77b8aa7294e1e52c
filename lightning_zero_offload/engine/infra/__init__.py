"""The buffers and streams under the step: host and device memory, pinned and pooled (:mod:`.memory`), the
ledger every buffer is recorded in (:mod:`.ledger`), streams, events and worker threads (:mod:`.streams`),
and the collectives over NCCL or gloo (:mod:`.collectives`)."""
