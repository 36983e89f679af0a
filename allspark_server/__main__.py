"""`python -m allspark_server`: one pool rank (allspark_server/pool/rank.py)."""
from allspark_server.pool.rank import main

if __name__ == "__main__":
    main()
