"""The parts of one step: the layout of the flat buffers (:mod:`.layout`), the gradient sources
(:mod:`.gradient_source`, the offload path's :mod:`.streamer` with its :mod:`.launch_order`, and
:mod:`.in_place`), the CPU state (:mod:`.cpu_state`), the update (:mod:`.update`), the copy back
(:mod:`.publisher`), users' writes to the weights (:mod:`.param_writes`), and what a schedule is lent
(:mod:`.parts`). None of them imports the orchestrator."""
