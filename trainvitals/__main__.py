from trainvitals.cli import main

main()
