/* A plain TCP relay for benchmarks/rpc_relay_hop.py: listens on a free loopback port (printed on
 * stdout), and relays each connection to 127.0.0.1:ARGV[1], one at a time, with poll, read and
 * write and nothing else: the cost of a hop, with no language and no checks in it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <poll.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <sys/socket.h>
int main(int argc, char **argv) {
  int up = atoi(argv[1]);
  int ls = socket(AF_INET, SOCK_STREAM, 0); int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {0}; a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(ls, (void*)&a, sizeof a); listen(ls, 8); socklen_t l = sizeof a; getsockname(ls, (void*)&a, &l);
  printf("%d\n", ntohs(a.sin_port)); fflush(stdout);
  static char buf[1 << 20];
  for (;;) {
    int c = accept(ls, 0, 0);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in b = {0}; b.sin_family = AF_INET; b.sin_addr.s_addr = htonl(INADDR_LOOPBACK); b.sin_port = htons(up);
    connect(s, (void*)&b, sizeof b);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct pollfd p[2] = {{c, POLLIN, 0}, {s, POLLIN, 0}};
    for (;;) {
      if (poll(p, 2, -1) < 0) break;
      int done = 0;
      for (int i = 0; i < 2; i++) if (p[i].revents) {
        ssize_t n = read(p[i].fd, buf, sizeof buf);
        if (n <= 0) { done = 1; break; }
        write(p[1 - i].fd, buf, n);
      }
      if (done) break;
    }
    close(c); close(s);
  }
}
