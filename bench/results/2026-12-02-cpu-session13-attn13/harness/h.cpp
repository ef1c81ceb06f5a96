#include "shim.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>
#include <chrono>
#include <sys/mman.h>
#include "simd.h"
namespace {
#include "body.inc"
}
#include "attention_f32.h"
using namespace std;
// cur = paged_attention.cpp as of 4e9db5d (prefetching item), new = the tree's attention_f32.h,
// read = READMODE 0..7 (see ../README.md). Env: OMP_NUM_THREADS, CPUT=1 (process CPU time), LAYERS, NB, FN, ITEM=N.
static double now(){ if(getenv("CPUT")){timespec ts; clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&ts); return ts.tv_sec+ts.tv_nsec*1e-9;} return chrono::duration<double>(chrono::steady_clock::now().time_since_epoch()).count();}
float* alloc(size_t n){
  size_t bytes=n*4, H=2<<20; bytes=(bytes+H-1)/H*H;
  char* raw=(char*)mmap(nullptr,bytes+H,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  char* s=(char*)(((uintptr_t)raw+H-1)/H*H);
  madvise(s,bytes,MADV_NOHUGEPAGE);
  float* f=(float*)s; for(size_t i=0;i<n;i++) f[i]=(float)((i*2654435761u)%1000)/1000.f-0.5f; return f;
}
struct Plan { int64_t part_len; std::vector<int64_t> first_item, split; int64_t items, nthreads; };
Plan plan(const int32_t* lp, int64_t B){
  Plan P; P.part_len=kMaxPartition; const int64_t want_items=4*at::get_num_threads();
  auto count_items=[&](int64_t len){int64_t n=0; for(int64_t b=0;b<B;++b) n+=std::max<int64_t>(1,(lp[b]+len-1)/len); return n;};
  while(P.part_len>kMinPartition && count_items(P.part_len)<want_items) P.part_len/=2;
  P.first_item.assign(B+1,0);
  for(int64_t b=0;b<B;++b) P.first_item[b+1]=P.first_item[b]+std::max<int64_t>(1,(lp[b]+P.part_len-1)/P.part_len);
  P.items=P.first_item[B];
  P.nthreads=std::max<int64_t>(1,std::min<int64_t>(at::get_num_threads(),P.items));
  P.split.assign(P.nthreads+1,P.items);
  { int64_t total=0; for(int64_t b=0;b<B;++b) total+=std::max<int64_t>(1,lp[b]); P.split[0]=0; int64_t acc=0,t=1,it=0;
    for(int64_t b=0;b<B&&t<P.nthreads;++b) for(int64_t p=P.first_item[b];p<P.first_item[b+1]&&t<P.nthreads;++p,++it){
      const int64_t t0=(p-P.first_item[b])*P.part_len; acc+=std::max<int64_t>(1,std::min<int64_t>(lp[b],t0+P.part_len)-t0);
      while(t<P.nthreads&&acc*P.nthreads>=total*t) P.split[t++]=it+1; } }
  return P;
}
void combine(const Plan& P, const float* part_m,const float* part_l,const float* part_acc,int64_t B,int64_t H,int64_t D,float* op){
  for(int64_t bh=0;bh<B*H;++bh){ const int64_t b=bh/H,h=bh%H; float* o=op+bh*D; float mx=-INFINITY;
    for(int64_t it=P.first_item[b];it<P.first_item[b+1];++it) mx=std::max(mx,part_m[it*H+h]);
    float den=0; std::fill(o,o+D,0.f);
    for(int64_t it=P.first_item[b];it<P.first_item[b+1];++it){ float w=std::exp(part_m[it*H+h]-mx); den+=w*part_l[it*H+h]; const float* a=&part_acc[(it*H+h)*D]; for(int c=0;c<D;c++) o[c]+=w*a[c]; }
    for(int c=0;c<D;c++) o[c]/=den; }
}
typedef void(*OldFn)(const Item&,const float*,const float*,const Shape&,float*);
typedef void(*NewFn)(const gpuserv_attn::Item&,const float*,const float*,const gpuserv_attn::Shape&,float*);
void run_old(OldFn f,const float* qp,const float* kp,const float* vp,const int32_t* tp,int64_t ts,const int32_t* lp,int64_t B,int64_t H,int64_t D,int64_t KVH,int64_t bs,float scale,float* op){
  const Shape sh{bs,KVH,H/KVH,D,KVH*D}; Plan P=plan(lp,B);
  std::vector<float> qs(B*H*D), pm(P.items*H), pl(P.items*H), pa(P.items*H*D); for(int64_t i=0;i<B*H*D;i++) qs[i]=qp[i]*scale;
#pragma omp parallel num_threads(P.nthreads)
  { int th=omp_get_thread_num(); std::vector<float> scores(H*(std::max(P.part_len,kChunk)+1));
    for(int64_t it=P.split[th];it<P.split[th+1];++it){ const int64_t b=std::upper_bound(P.first_item.begin(),P.first_item.end(),it)-P.first_item.begin()-1;
      const int64_t t0=(it-P.first_item[b])*P.part_len, t1=std::min<int64_t>(lp[b],t0+P.part_len);
      const Item item{&qs[b*H*D],tp+b*ts,t0,t1,&pm[it*H],&pl[it*H],&pa[it*H*D],qp,0,scale}; f(item,kp,vp,sh,scores.data()); } }
  combine(P,pm.data(),pl.data(),pa.data(),B,H,D,op);
}
void run_new(NewFn f,const float* qp,const float* kp,const float* vp,const int32_t* tp,int64_t ts,const int32_t* lp,int64_t B,int64_t H,int64_t D,int64_t KVH,int64_t bs,float scale,float* op){
  using namespace gpuserv_attn;
  const gpuserv_attn::Shape sh{bs,KVH,H/KVH,D,KVH*D}; Plan P=plan(lp,B);
  std::vector<float> qs(B*H*D), pm(P.items*H), pl(P.items*H), pa(P.items*H*D); for(int64_t i=0;i<B*H*D;i++) qs[i]=qp[i]*scale;
#pragma omp parallel num_threads(P.nthreads)
  { int th=omp_get_thread_num(); std::vector<float> scores(H*(std::max(P.part_len,kStep)+1)+f32_buffer_floats(sh.row_stride));
    for(int64_t it=P.split[th];it<P.split[th+1];++it){ const int64_t b=std::upper_bound(P.first_item.begin(),P.first_item.end(),it)-P.first_item.begin()-1;
      const int64_t t0=(it-P.first_item[b])*P.part_len, t1=std::min<int64_t>(lp[b],t0+P.part_len);
      gpuserv_attn::Item item{&qs[b*H*D],tp+b*ts,t0,t1,&pm[it*H],&pl[it*H],&pa[it*H*D],qp,0,scale}; f(item,kp,vp,sh,scores.data()); } }
  combine(P,pm.data(),pl.data(),pa.data(),B,H,D,op);
}
static int READMODE = 0;
void read_item(const Item& it, const float* k, const float* v, const Shape& sh, float* scores){
  __m256 a=_mm256_setzero_ps(), b=_mm256_setzero_ps();
  const int64_t rs=sh.row_stride, bs=sh.block_size;
  auto rowof=[&](int64_t t){ return (int64_t)it.table[t/bs]*bs+t%bs; };
  if(READMODE==2){ // kernel-like order: per 16-token run, per head slice, strided rows
    for_each_run(it.table, bs, it.t0, it.t1, [&](int64_t row, int64_t count){
      for(int64_t h=0;h<sh.kv_heads;h++) for(int64_t r=0;r<count;r++){ const float* kr=k+(row+r)*rs+h*sh.D; for(int64_t c=0;c<sh.D;c+=16) a=_mm256_add_ps(a,_mm256_add_ps(_mm256_loadu_ps(kr+c),_mm256_loadu_ps(kr+c+8))); }
      for(int64_t h=0;h<sh.kv_heads;h++) for(int64_t c0=0;c0<sh.D;c0+=32) for(int64_t r=0;r<count;r++){ const float* vr=v+(row+r)*rs+h*sh.D+c0; b=_mm256_add_ps(b,_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(vr),_mm256_loadu_ps(vr+8)),_mm256_add_ps(_mm256_loadu_ps(vr+16),_mm256_loadu_ps(vr+24)))); }
    });
  } else if(READMODE==6 || READMODE==7){ // kernel order on this run, after a lockstep sequential touch of the next run's K/V lines
    __m256 z=_mm256_setzero_ps();
    auto touch=[&](int64_t row,int64_t count){ const float* kr=k+row*rs; const float* vr=v+row*rs; int64_t n=count*rs;
      for(int64_t i=0;i<n;i+=16){ if(READMODE==6){ z=_mm256_add_ps(z,_mm256_add_ps(_mm256_loadu_ps(kr+i),_mm256_loadu_ps(vr+i))); } else { _mm_prefetch((const char*)(kr+i),_MM_HINT_T1); _mm_prefetch((const char*)(vr+i),_MM_HINT_T1);} } };
    int64_t prow=-1,pcount=0;
    std::vector<std::pair<int64_t,int64_t>> runs; for_each_run(it.table, bs, it.t0, it.t1, [&](int64_t row, int64_t count){ runs.push_back({row,count}); });
    if(!runs.empty()) touch(runs[0].first, runs[0].second);
    for(size_t ri=0; ri<runs.size(); ri++){ int64_t row=runs[ri].first, count=runs[ri].second;
      if(ri+1<runs.size()) touch(runs[ri+1].first, runs[ri+1].second);
      for(int64_t h=0;h<sh.kv_heads;h++) for(int64_t r=0;r<count;r++){ const float* kr=k+(row+r)*rs+h*sh.D; for(int64_t c=0;c<sh.D;c+=16) a=_mm256_add_ps(a,_mm256_add_ps(_mm256_loadu_ps(kr+c),_mm256_loadu_ps(kr+c+8))); }
      for(int64_t h=0;h<sh.kv_heads;h++) for(int64_t c0=0;c0<sh.D;c0+=32) for(int64_t r=0;r<count;r++){ const float* vr=v+(row+r)*rs+h*sh.D+c0; b=_mm256_add_ps(b,_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(vr),_mm256_loadu_ps(vr+8)),_mm256_add_ps(_mm256_loadu_ps(vr+16),_mm256_loadu_ps(vr+24)))); }
    }
    a=_mm256_add_ps(a,z); (void)prow; (void)pcount;
  } else if(READMODE==3){ // per run: K rows sequential, then V rows sequential
    for_each_run(it.table, bs, it.t0, it.t1, [&](int64_t row, int64_t count){
      const float* kr=k+row*rs; const float* vr=v+row*rs; int64_t n=count*rs;
      for(int64_t i=0;i<n;i+=16) a=_mm256_add_ps(a,_mm256_add_ps(_mm256_loadu_ps(kr+i),_mm256_loadu_ps(kr+i+8)));
      for(int64_t i=0;i<n;i+=16) b=_mm256_add_ps(b,_mm256_add_ps(_mm256_loadu_ps(vr+i),_mm256_loadu_ps(vr+i+8)));
    });
  } else if(READMODE>=4){ // groups of GT tokens: K h-major, V (h,tile)-major within the group
    const int64_t GT = READMODE==4 ? 4 : 8;
    for_each_run(it.table, bs, it.t0, it.t1, [&](int64_t row0, int64_t count){
      for(int64_t g0=0; g0<count; g0+=GT){ int64_t gn=std::min(GT,count-g0); int64_t row=row0+g0;
      for(int64_t h=0;h<sh.kv_heads;h++) for(int64_t r=0;r<gn;r++){ const float* kr=k+(row+r)*rs+h*sh.D; for(int64_t c=0;c<sh.D;c+=16) a=_mm256_add_ps(a,_mm256_add_ps(_mm256_loadu_ps(kr+c),_mm256_loadu_ps(kr+c+8))); }
      for(int64_t h=0;h<sh.kv_heads;h++) for(int64_t c0=0;c0<sh.D;c0+=32) for(int64_t r=0;r<gn;r++){ const float* vr=v+(row+r)*rs+h*sh.D+c0; b=_mm256_add_ps(b,_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(vr),_mm256_loadu_ps(vr+8)),_mm256_add_ps(_mm256_loadu_ps(vr+16),_mm256_loadu_ps(vr+24)))); }
      }
    });
  } else {
  int64_t t=it.t0;
  for_each_run(it.table, bs, it.t0, it.t1, [&](int64_t row, int64_t count){
    const float* kr=k+row*rs; const float* vr=v+row*rs; int64_t n=count*rs;
    for(int64_t i=0;i<n;i+=16){
      if(READMODE==1 && (i%(rs))==0){ int64_t tt=t+i/rs+32; if(tt<it.t1){ int64_t rr=rowof(tt); const char* pk=(const char*)(k+rr*rs); const char* pv=(const char*)(v+rr*rs); for(int64_t o=0;o<rs*4;o+=64){_mm_prefetch(pk+o,_MM_HINT_T1);_mm_prefetch(pv+o,_MM_HINT_T1);} } }
      a=_mm256_add_ps(a,_mm256_add_ps(_mm256_loadu_ps(kr+i),_mm256_loadu_ps(kr+i+8))); b=_mm256_add_ps(b,_mm256_add_ps(_mm256_loadu_ps(vr+i),_mm256_loadu_ps(vr+i+8)));}
    t+=count;
  });
  }
  it.m[0]=hsum(_mm256_add_ps(a,b)); for(int i=1;i<9;i++) it.m[i]=0; it.l[0]=1;
}
int main(int argc,char**argv){
  READMODE=getenv("READMODE")?atoi(getenv("READMODE")):0;
  int B=atoi(argv[1]), L=atoi(argv[2]); int reps=argc>3?atoi(argv[3]):20;
  const int H=9,KVH=3,D=64,bs=16; const int LAY=getenv("LAYERS")?atoi(getenv("LAYERS")):30; int NB=atoi(getenv("NB")?getenv("NB"):"1024");
  size_t per=(size_t)NB*bs*KVH*D;
  std::vector<float*> K(LAY),V(LAY); for(int l=0;l<LAY;l++){K[l]=alloc(per);V[l]=alloc(per);}
  std::mt19937 rng(1); std::vector<int> perm(NB); for(int i=0;i<NB;i++)perm[i]=i; std::shuffle(perm.begin(),perm.end(),rng);
  int nbl=(L+bs-1)/bs; std::vector<int32_t> table(B*nbl), lens(B,L); for(int i=0;i<B*nbl;i++) table[i]=perm[i];
  for(int b=0;b<B;b++) lens[b]=L-(b*7)%13;
  std::vector<float> q(B*H*D); for(auto&x:q) x=(rng()%1000)/1000.f-0.5f; std::vector<float> out(B*H*D), ref(B*H*D);
  float scale=0.125f;
  OldFn fo=attend_item_fixed<float,3,32>; 
#define NEWFN gpuserv_attn::attend_item_f32<3,32>
  NewFn fn=NEWFN;
  run_old(fo,q.data(),K[0],V[0],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,ref.data());
  run_new(fn,q.data(),K[0],V[0],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,out.data());
  double md=0; for(size_t i=0;i<out.size();i++) md=std::max(md,(double)fabs(out[i]-ref[i])); printf("maxdiff %.3g\n",md);
  if(getenv("ITEM")){ // pure compute: one item of L tokens, KV in L2, direct calls
    using namespace gpuserv_attn; int reps2=atoi(getenv("ITEM"));
    std::vector<float> qs(H*D); for(int i=0;i<H*D;i++) qs[i]=q[i]*scale; std::vector<float> m(H),l(H),acc(H*D),sc(H*(L+40)+2*32*KVH*D);
    ::Item io{qs.data(),table.data(),0,L,m.data(),l.data(),acc.data(),nullptr,0,scale};
    gpuserv_attn::Item in{qs.data(),table.data(),0,L,m.data(),l.data(),acc.data(),nullptr,0,scale};
    const ::Shape so{bs,KVH,H/KVH,D,KVH*D}; const gpuserv_attn::Shape sn{bs,KVH,H/KVH,D,KVH*D};
    double bo=1e9,bn=1e9;
    for(int r=0;r<reps2;r++){ double t=now(); for(int i=0;i<20;i++) fo(io,K[0],V[0],so,sc.data()); bo=std::min(bo,(now()-t)/20);
      t=now(); for(int i=0;i<20;i++) fn(in,K[0],V[0],sn,sc.data()); bn=std::min(bn,(now()-t)/20); }
    printf("item L=%d: cur %.1f ns/tok  new %.1f ns/tok\n",L,bo*1e9/L,bn*1e9/L); return 0; }
  double tok=0; for(int b=0;b<B;b++) tok+=lens[b]; double bytes=tok*KVH*D*2*4;
  const char* names[3]={"cur","new","read"};
  std::vector<std::vector<double>> ts(3);
  for(int r=0;r<reps;r++) for(int f=0;f<3;f++){ int ff=(r%2)?2-f:f; if(getenv("FN") && !strstr(getenv("FN"),names[ff])) continue; double t=now();
      for(int l=0;l<LAY;l++){ if(ff==0) run_old(fo,q.data(),K[l],V[l],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,out.data());
        else if(ff==1) run_new(fn,q.data(),K[l],V[l],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,out.data());
        else run_old(read_item,q.data(),K[l],V[l],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,out.data()); }
      ts[ff].push_back((now()-t)/LAY);}
  for(int f=0;f<3;f++){ if(ts[f].empty()) continue; std::sort(ts[f].begin(),ts[f].end()); double m=ts[f][0], md=ts[f][ts[f].size()/2];
    printf("%-5s B=%d L=%d thr=%d: min %.1f med %.1f us/layer  %.1f ns/tok  %.2f GB/s\n",names[f],B,L,omp_get_max_threads(),m*1e6,md*1e6,m*1e9/tok*(getenv("CPUT")?1:omp_get_max_threads()),bytes/m/1e9);}
}
