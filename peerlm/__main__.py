from peerlm.app.cli import main

main()
