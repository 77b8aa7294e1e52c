"""The parameter-offload mode: the model on torch FSDP2, its sharded parameters stepped on the host."""
