from kvbridge.cli.main import main

main()
