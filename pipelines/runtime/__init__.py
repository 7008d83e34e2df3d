"""What a stage runs with: its contract (`contract`: the context it sees, what it returns, the spec of its
training subprocesses), the `accelerate launch` of those subprocesses (`launch`) and their side of it
(`process`), the nodes of a multi-node run (`nodes`), the devices and their rates (`cluster`), the target's
copies (`target`), wandb (`tracking`) and the manifest each stage leaves (`manifest`)."""
