from cli.launch import console

console()
