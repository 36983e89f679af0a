"""The in-process engine: `Engine` (the public API), its engine thread, and the served model with its step loops."""
