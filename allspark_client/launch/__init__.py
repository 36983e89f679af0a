"""allspark-launch and allspark-health: starting a pool as one mpirun job (its options, config file, placement,
mpirun command, directories and watches), the pool ClientEngine spawns for itself, and the readiness probe."""
