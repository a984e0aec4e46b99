"""The tuner's glue: short emulated trials, the report, and the online H controller
that steers a running job through the control plane (the reasoning is
:mod:`isthmus.sim.tuner`)."""
