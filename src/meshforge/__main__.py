from meshforge.cli import entry

entry()
