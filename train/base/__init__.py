"""What every room of train/ stands on: the training config, every key
with its type, default and rule (train_config), the error types a user's
mistake or a failed run becomes (errors), library notices silenced (quiet),
how the hosts of a multi-host run agree (hosts), and the files of a run on
a disk or an object store (storage). Imports nothing
from train/ but itself."""
