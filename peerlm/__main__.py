from peerlm.cli import main

main()
