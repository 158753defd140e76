"""The simulation engine: client banks, the flat working model, optimizers over banks,
local training, rounds, communication accounting, run directories and checkpoints."""
