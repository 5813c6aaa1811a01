"""What one compiled step is made of: the device mesh and where arrays go
on it (mesh, sharding), the loss (cross_entropy) and the pure train and eval
step functions (steps), the optimizer and its schedules (optim), and what a
step costs (flops, device_memory). Imports train.base and train.data."""
