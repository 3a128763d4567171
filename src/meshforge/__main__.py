from meshforge.cli.main import entry

entry()
