"""A model built on the meta device, given its values one unit at a time, never whole: the plan and the
initialization both modes share (:mod:`.initialization`), PEFT's adapters in it (:mod:`.peft_adapters`), and the
ZeRO-2 mode's fill into the engine (:mod:`.blockwise`; the parameter-offload mode's is
``engine/offload_params/materialize.py``)."""
