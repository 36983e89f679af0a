"""Model building blocks; the only place model code meets collectives (through a comm object)."""
