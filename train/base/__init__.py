"""What every room of train/ stands on: the training config, every key
with its type, default and rule (train_config), the error types a user's
mistake or a failed run becomes (errors), library notices silenced (quiet),
and how the hosts of a multi-host run agree (hosts). Imports nothing from
train/ but itself."""
