from kvbridge.cli.main import app

app(prog_name="kvbridge")
