"""`python -m allspark_server.http`: the allspark-serve command."""
import sys

from allspark_server.http.cli import main

sys.exit(main())
