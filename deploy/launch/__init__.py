"""Running a job: the local launcher, each rank's worker, the embedded broker,
live progress, the records a run leaves, its summary, report and comparison."""
