"""The training settings moved to :mod:`isthmus.job.settings` (the job model, below
every layer); this name stays for code written against it."""

from isthmus.job.settings import (  # noqa: F401
    CODECS,
    LATE_CONTRIBUTIONS,
    SCHEDULES,
    SETTING_NAMES,
    STRATEGIES,
    SettingError,
    TrainSettings,
    check_late_contributions,
)
