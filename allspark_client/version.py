"""allspark's version (the client's and the server's: one distribution), written into model files and compared
with theirs at install."""
__version__ = "0.1.0"
